"""The front door: gRPC API, tokenizer at the edge, placement, stream relay."""
