"""The router's edge: the gRPC and HTTP (OpenAI) servers, TLS, API keys, input limits, and the
parsing of a request into prompt tokens and sampling parameters."""
