"""Generated gRPC stubs for proto/helexa/neuron/v1/neuron.proto (see helexa.proto_gen)."""
