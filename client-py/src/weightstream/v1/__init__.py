"""Generated gRPC stubs of proto/weightstream/v1/weightstream.proto (grpcio-tools 1.84.0)."""
