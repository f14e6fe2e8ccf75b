"""kvbridge: leases, pins and routing that let prefill engines reuse decode-held KV cache.

Public modules:
- `kvbridge.blockhash`: the chained per-block hash shared by registry, connector and tests.
- `kvbridge.clock`: the injectable monotonic clock (`SystemClock`, `FakeClock`).
- `kvbridge.errors`: domain errors and their one mapping to gRPC status codes.
- `kvbridge.services.registry`: the lease registry (core, gRPC servicer, server).
- `kvbridge.clients`: sync and asyncio registry clients and the holder session.
"""

__version__ = "0.1.0"
