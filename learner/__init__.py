"""clora.learner — per-tenant LoRA adapters trained from the replay buffers, gated and published.

| module          | owns |
|-----------------|------|
| `process`       | `Learner`, the tick loop (serial and fused), and `main`, the `clora learner` entry point |
| `tenant`        | `LearnerTenant`: the loop's record of one tenant (checkpoint due, back-off, flat check, gate cache) |
| `lifecycle`     | `TenantLifecycle`: load a tenant's newest checkpoint or register it, drop it, checkpoint, follow the live version |
| `leases`        | `RedisLeases`, `SoleLearner`: which learner trains which tenant (leases with fencing tokens, fair share, failover) |
| `ownership`     | `Ownership`: what the loop does as leases are taken, lost and handed back |
| `sampling`      | `Sampler`: a tenant's next batch from the replay buffer; flat RL batches consumed without a step |
| `backoff`       | `Backoff`, `StepFailures`: a failed step is logged and counted, and its tenant waits |
| `gate`          | `PublishGate`: candidate vs live held-out loss, the live-loss cache, drift, the decision, publish and prune |
| `rollback`      | `RewardRollback`: the reward guards' rounds and the rollbacks (and pauses) they decide |
| `reward_guard`  | `judge`: whether a live version's served rewards dropped below its ancestor's |
| `hacking_guard` | `judge`: whether a live version's rewards held up while its served replies degenerated |
| `drift`         | `DriftProbe`: a candidate's KL from the base on the shipped general-purpose prompts (the forgetting guard) |
| `scheduler`     | `Scheduler`: weighted fair share over training time, which tenant(s) train next |
| `trainer`       | `Trainer`, `TrainingPolicy`: one optimizer step for one tenant, held-out losses |
| `fused`         | `FusedTrainer`: one optimizer step for each of K tenants from shared forwards and backwards |
| `fused_batch`   | `FusedRows`, `plan_chunks`, `FusedBinding`: fused batches, length buckets, their LoRA binding |
| `fused_slots`   | `FusedSlots`: K tenants resident on the device at once |
| `adapter_store` | `AdapterState`, `AdapterStore`: every tenant's state on the host, one resident on the device |
| `copy_engine`   | host <-> device copy engines (sync, background thread, CUDA stream) |
| `checkpoint`    | per-tenant checkpoints of the full training state: the file format, and `Checkpoints` under a fencing token |
| `publish`       | `Publisher`: versioned adapter folders, recorded in the registry and announced |
| `peft_io`       | adapters on disk in PEFT format |
| `lora`          | `LoraSpec`, `LoraLayout`, `LoraModel`: LoRA on the frozen base, one flat buffer per adapter |
| `optim`         | AdamW over one tenant's flat state buffer |
| `losses`        | SFT, DPO, RL (grouped and baseline) and KTO losses as pure functions of log-probabilities |
| `mixed`         | `StepPlan`: a mixed step's (`auto`, `kto`) examples split by loss term, with advantages |
| `batches`       | `ChatEncoder`, `TokenBatch`: examples to padded token batches; RL turns packed |
| `base_model`    | the frozen base model: prepared once, loaded; the tiny test model |
| `chat_template` | the tool-aware chat template the model is trained and served with |
| `metrics`       | `LearnerMetrics` (Prometheus) and `append_history` (the console's per-tenant charts) |
| `settings`      | `LearnerSettings` (`CLORA_LEARNER_*`) |
"""
