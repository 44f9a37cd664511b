"""clora: continuous learning for LLM agents.

The top-level folders (`ingest/`, `serving/`, `learner/`, `kernels/`, `agents/`,
`infra/`) install as `clora.<name>`; see pyproject's `package-dir`.
"""

__version__ = "0.1.0"
