"""kvbridge benchmarks (`kvbridge bench ...`)."""
