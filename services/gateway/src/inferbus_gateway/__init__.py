"""inferbus gateway: KServe V2 gRPC and REST front door of the platform."""
