"""Placeholder replaced below."""
import click

@click.command("registry")
def registry_bench() -> None:
    """Registry benchmark."""
