"""Deployment: worker pools on Ray (or in one process), wired to the router."""
