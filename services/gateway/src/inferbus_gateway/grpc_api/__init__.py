"""KServe V2 gRPC front end (`inference.GRPCInferenceService`)."""
