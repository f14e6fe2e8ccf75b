"""The `kvbridge` console script: gRPC settings first (`kvbridge.grpc_env`), then the CLI.

Kept apart from `kvbridge.cli` so that importing the CLI (to embed or test its commands) changes
nothing in the importing process's environment.
"""

from __future__ import annotations

import sys

from kvbridge import grpc_env


def main() -> None:
    grpc_env.apply_server_defaults(sys.argv[1:])  # before anything imports grpc
    from kvbridge.cli import main as cli

    cli()
