"""The `kvbridge` command."""

from __future__ import annotations

import sys

if __name__ == "__main__":  # `python -m kvbridge.cli`: as the console script (kvbridge._entry)
    from kvbridge import grpc_env

    grpc_env.apply_server_defaults(sys.argv[1:])  # before anything imports grpc

import click

from kvbridge import __version__, logs
from kvbridge.clients._cli import holders_group, leases_group
from kvbridge.services.gateway._cli import gateway_group
from kvbridge.services.registry._cli import registry_group
from kvbridge.services.router._cli import instances_group, router_group
from kvbridge.tiny_model import model_group


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kvbridge")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="warning", show_default=True, envvar="KVBRIDGE_LOG_LEVEL",
              help="log level of client commands (services take their own --log-level)")
def main(log_level: str) -> None:
    """kvbridge: leases that let prefill engines reuse the KV cache decode engines hold.

    \b
    Everything: kvbridge up [--cpu-engines] [--demo N], kvbridge demo
    Services:   kvbridge registry serve, kvbridge router serve, kvbridge gateway serve,
                kvbridge engine run (vLLM with the connector, attached to a router)
    Operations: kvbridge doctor, kvbridge leases list|show|renew|revoke|watch,
                kvbridge holders list, kvbridge instances list
    Benchmarks: kvbridge bench registry, kvbridge bench multiturn,
                kvbridge bench agentic, kvbridge bench lease-policy,
                kvbridge bench soak
    Demo:       kvbridge demo (through a gateway), kvbridge registry demo (leases only)
    Models:     kvbridge model make-tiny PATH
    Security:   kvbridge auth token|check (token tables for --auth-tokens-file)
    Testing:    kvbridge fault-proxy (delay, drop or reset traffic between components)
    """
    logs.configure(log_level, "auto")


@click.group("bench")
def bench_group() -> None:
    """Benchmarks that print figures (JSON with --json)."""


def _register_benchmarks() -> None:
    from kvbridge.benchmarks.agentic import agentic_bench
    from kvbridge.benchmarks.lease_policy import lease_policy_bench
    from kvbridge.benchmarks.multiturn import multiturn_bench
    from kvbridge.benchmarks.registry_bench import registry_bench
    from kvbridge.benchmarks.soak import soak_bench

    bench_group.add_command(registry_bench)
    bench_group.add_command(multiturn_bench)
    bench_group.add_command(agentic_bench)
    bench_group.add_command(lease_policy_bench)
    bench_group.add_command(soak_bench)


_register_benchmarks()
def _register_stack() -> None:
    from kvbridge.auth_cli import auth_group
    from kvbridge.demo import demo_command
    from kvbridge.doctor import doctor_command
    from kvbridge.engine_cli import engine_group
    from kvbridge.faultproxy import fault_proxy_command
    from kvbridge.stack import up_command

    main.add_command(auth_group)
    main.add_command(up_command)
    main.add_command(demo_command)
    main.add_command(engine_group)
    main.add_command(doctor_command)
    main.add_command(fault_proxy_command)


_register_stack()
for group in (registry_group, router_group, gateway_group, instances_group, leases_group,
              holders_group, bench_group, model_group):
    main.add_command(group)

if __name__ == "__main__":
    main()
