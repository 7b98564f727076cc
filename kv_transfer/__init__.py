"""The KV data path: NIXL agents over UCX that read block lists from other workers' KV pools."""
