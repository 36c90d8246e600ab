"""Tandem's benchmarks (`python -m benchmarks.<name>` from the repo root; RESULTS.md holds their figures)."""
import tandem.engine  # noqa: F401 (first: Hugging Face's kernels package ahead of the root's kernels/ folder)
