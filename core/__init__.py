"""clora: continuous learning for LLM agents.

This package is the ground every part stands on; it imports nothing else of clora's.

| module     | owns |
|------------|------|
| `settings` | what the platform shares (data dir, Kafka and Redis URLs), `settings_config` every service's settings use |
| `registry` | the control-plane registry in Redis: tenants, hashed keys, policies, adapter versions, the live one |
| `reward_spec` | a tenant's reward spec: which feedback keys and sources train, and how each maps to a reward |
| `freshness` | feedback -> served latency: a version's lineage (events first trained in it) and its summary |
| `canary`   | a version's canary: the learner's log-probabilities of a prompt, which each serving replica must reproduce |
| `ids`      | tenant ids, event ids, the served name `tenant@vN` |
| `procs`    | process helpers: open ports, free ports, health URLs, children that die with their parent |
| `web`      | the HTTP front door the webhook, gateway and control API share: keys, body limits, the error envelope |
| `storage`  | where adapter versions live: the local folder or an S3-compatible store, checksummed, fetched into a verified cache |
| `checkpoint_storage` | where learners keep training-state checkpoints: the same local folder or store, entries ordered and fenced by lease token |
| `fencing`  | `Fence`, `FencedOut`: the lease a write presents, and the refusal when another holder took over |

The parts install beside it as `clora.<folder>` (pyproject's `package-dir`): `ingest`,
`serving`, `learner`, `kernels`, `agents`, and `infra`, the top that composes them. The
layering contract in pyproject (`[tool.importlinter]`) says who may import whom.
"""

__version__ = "0.1.0"
