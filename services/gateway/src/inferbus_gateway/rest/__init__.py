"""KServe V2 REST front end (`/v2/...`), JSON and binary tensor data."""
