"""clora.serving — the OpenAI-compatible gateway over vLLM replicas serving every tenant's
live LoRA adapter version.

| module          | owns |
|-----------------|------|
| `service`       | engine replicas + gateway as one unit that `clora up` or a test starts and stops |
| `gateway`       | the FastAPI app: authentication, tenant -> adapter routing, quotas, streaming, logging |
| `errors`        | the errors the gateway answers, in OpenAI's shape |
| `request_fields`| the allow-list: request fields the gateway accepts and forwards, checked for type and range |
| `completions`   | the upstream request sent to vLLM, the client's response, the recorded interaction events |
| `tinker_sampling` | the Tinker training API's token-level sampling route: request, upstream body, answer |
| `aliases`       | `AdapterRef` (one immutable version) and the tenant -> live version table |
| `hotswap`       | keeping each tenant's alias on the registry's live version (load, switch, drain, unload) |
| `engine`        | the replicas behind the gateway, local and remote: routing, verified loading, eviction, restarts |
| `replica`       | one vLLM server, a local child process or a remote URL, and the HTTP calls made to it |
| `canary`        | verifying a freshly loaded adapter on a replica with its version's canary (`clora.canary`) |
| `residency`     | registered vs resident adapters of one replica (LRU, pins), and the adapters it refused |
| `fair_queue`    | fair admission: engine sequences in flight, queued per tenant, weighted fair over tokens |
| `quota`         | per-tenant concurrency (requests, sequences, pinned versions) and rate limits (429) |
| `record_quota`  | per-tenant byte quota on recorded messages and tools (429) |
| `quota_store`   | where both quotas count: Redis, shared by every gateway, or local; the fallback when Redis fails |
| `tenant_slots`  | each tenant's requests in flight as leases: in this process, and in Redis with expiry |
| `interactions`  | sending interaction events to Kafka off the request path, spooling through outages |
| `spool`         | the fsync'd local spool of records the broker did not take |
| `traffic`       | per-tenant, per-minute traffic counters for the console |
| `freshness`     | each version's first served completion: feedback -> served latency (claimed once) |
| `metrics`       | the gateway's Prometheus metrics |
| `settings`      | `EngineSettings` and `GatewaySettings` |
| `zero_adapter`  | the all-zero adapter served in place of "no adapter" on CPU |
| `vllm_cpu_lora` | clora's replacement for vLLM's CPU LoRA ops |
| `vllm_launch`   | getting those ops into every process of a vLLM replica |
"""
