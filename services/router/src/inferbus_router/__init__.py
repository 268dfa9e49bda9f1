"""inferbus router: picks the version of each request and forwards it on NATS headers alone."""
