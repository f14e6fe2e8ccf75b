"""kvbridge services: the lease registry (and, later, routing and the gateway)."""
