"""`kvbridge up`'s engine layout and its argument checks (the engines themselves run in
tests/e2e/test_two_decodes_e2e.py and test_gateway_e2e.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kvbridge.cli import main
from kvbridge.stack import engine_cores


@pytest.mark.parametrize(("prefills", "decodes", "cpus", "expected"), [
    (1, 1, 2, [("prefill", 0, 0), ("decode", 0, 1)]),
    # Two decodes on two cores: the prefill keeps its core, the decodes share the other.
    (1, 2, 2, [("prefill", 0, 0), ("decode", 0, 1), ("decode", 1, 1)]),
    (1, 3, 4, [("prefill", 0, 0), ("decode", 0, 1), ("decode", 1, 2), ("decode", 2, 3)]),
    # Prefills took every core: decodes go round robin over all of them.
    (2, 3, 2, [("prefill", 0, 0), ("prefill", 1, 1), ("decode", 0, 0), ("decode", 1, 1),
               ("decode", 2, 0)]),
    (1, 1, 1, [("prefill", 0, 0), ("decode", 0, 0)]),
])
def test_engine_cores(prefills: int, decodes: int, cpus: int,
                      expected: list[tuple[str, int, int]]) -> None:
    assert engine_cores(prefills, decodes, cpus) == expected


@pytest.mark.parametrize("argv", [["--decodes", "2"], ["--prefills", "2"],
                                  ["--kv-cache-mb", "64"], ["--no-prefill-prefix-caching"]])
def test_engine_counts_need_cpu_engines(argv: list[str]) -> None:
    result = CliRunner().invoke(main, ["up", *argv])
    assert result.exit_code == 2
    assert "--no-prefill-prefix-caching need --cpu-engines" in result.output


@pytest.mark.parametrize("argv", [["--decodes", "0"], ["--prefills", "9"]])
def test_engine_counts_out_of_range_are_usage_errors(argv: list[str]) -> None:
    result = CliRunner().invoke(main, ["up", "--cpu-engines", *argv])
    assert result.exit_code == 2
    assert "is not in the range" in result.output


def test_the_stack_serves_the_registrys_and_the_routers_metrics(tmp_path) -> None:
    """`kvbridge up` without engines: registry and router metrics on loopback ports of their
    own, named in the ready JSON and scraped here over HTTP."""
    import asyncio
    import json
    import urllib.request

    from kvbridge.stack import UpOptions, Urls, run_stack

    seen: dict[str, str] = {}

    async def on_ready(urls: Urls) -> None:
        for name in ("registry_metrics", "router_metrics"):
            url = getattr(urls, name)
            seen[name] = await asyncio.to_thread(
                lambda u=url: urllib.request.urlopen(u, timeout=10).read().decode())

    ready = tmp_path / "ready.json"
    opts = UpOptions(registry_listen="127.0.0.1:0", router_listen="127.0.0.1:0",
                     gateway_listen="127.0.0.1:0", work_dir=tmp_path, ready_json=ready)
    asyncio.run(run_stack(opts, asyncio.Event(), on_ready))
    written = json.loads(ready.read_text())
    assert written["registry_metrics"].startswith("http://127.0.0.1:")
    assert written["router_metrics"].startswith("http://127.0.0.1:")
    assert "kvbridge_registry_leases" in seen["registry_metrics"]
    assert "kvbridge_router_" in seen["router_metrics"]
