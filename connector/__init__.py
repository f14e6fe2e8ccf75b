"""The kvbridge vLLM KV connector.

Load it in an engine with
`--kv-transfer-config '{"kv_connector": "KVBridgeConnector",
"kv_connector_module_path": "kvbridge.connector", ...}'`. Importing this package does not import
vLLM; `KVBridgeConnector` is resolved on first access.
"""

from __future__ import annotations

from typing import Any

from kvbridge.connector._settings import CONVERSATION_KEY, ConnectorSettings, conversation_of

__all__ = ["CONVERSATION_KEY", "ConnectorSettings", "KVBridgeConnector", "conversation_of"]


def __getattr__(name: str) -> Any:
    if name == "KVBridgeConnector":
        from kvbridge.connector._connector import KVBridgeConnector

        return KVBridgeConnector
    raise AttributeError(name)
