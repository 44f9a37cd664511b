"""clora.infra: the top, the infrastructure that runs everything. It composes the parts, and
no part imports it.

| module        | owns |
|---------------|------|
| `cli`         | the `clora` command |
| `platform`    | `clora up`: every service as a supervised process |
| `stack`       | the embedded broker (Tansu) and Redis, or the external ones configured |
| `supervisor`  | `ManagedProcess`: start, health-check, restart and stop one child |
| `settings`    | the embedded broker's, Redis's and the console's settings |
| `control`     | the control-plane API and the tenant admin console (`static/`) |
| `demo`        | `clora demo`: three tenants learning from simulated traffic |
| `experiments` | `clora bench experiments`: concurrent RL experiments against sequential ones |
| `freshness_bench` | `clora bench freshness`: feedback -> served latency under a steady stream |
| `tinker_bench` | `clora bench tinker`: an RL step through the Tinker SDK vs native; concurrent SDK clients |
| `bench_platform` | fresh platforms for those benchmarks (`PlatformLauncher`) and where they answer |
| `cluster` | `Cluster`: every service its own process on one machine, sharing only broker, Redis and an S3 store |
| `scale_bench` | `clora bench scale`: ingest and serving with 1 vs 2 instances, a learner's failover |
| `tenants_bench` | `clora bench tenants`: many tenants' adapters over a replica's slots, vs in-cache |
| `fairness_bench` | `clora bench fairness`: 10:1 skew, served and trained tokens' fair shares, off vs on |
"""
