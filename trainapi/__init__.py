"""clora.trainapi — a Tinker-compatible training API: the official `tinker` SDK drives clora unchanged.

A Tinker model is a **named run under a tenant**: the tenant is the one whose Tinker key
(`tml-...`, `Registry.create_tinker_key`) created the session, and the run's adapter state is its
own entry in the learner's swapped store (`backend.run_key`), apart from the tenant's
continuously learned adapter. Requests name it by the model id the SDK builds,
`{session_id}:train:{n}`; another tenant's id is answered as unknown (404).

| module                     | owns |
|----------------------------|------|
| `app`                      | `create_app`: the `/api/v1` routes, auth, the error shape, checks, `retrieve_future` |
| `service`                  | `clora trainapi`: the app on the registry and Redis, served by uvicorn |
| `queue`                    | requests and their futures in Redis, from the API process to the learner |
| `executor`                 | `TinkerWork`: the learner runs a run's requests when its scheduler picks the run |
| `runs`                     | `Session`, `TinkerModel`, model ids, and `RunStore` keeping them (and seq order) in Redis |
| `sequencer`                | `Sequencer`: per-model `seq_id` order, retries, gaps |
| `backend`                  | `InProcessBackend`: a run's forward/backward, AdamW and weights on the learner's `Trainer` |
| `losses`                   | `cross_entropy`, `importance_sampling`, `ppo` as token sums on the learner's loss math |
| `sampling`                 | sampling sessions and `asample`, through the OpenAI gateway and the shared vLLM engine |
| `wire`                     | the protobuf messages (private pool), decoding requests, encoding results, zstd |
| `tinker_public_descriptor` | the SDK's `tinker_public.proto` schema, vendored as a serialized descriptor |
| `weights`                  | `tinker://` paths, checkpoint folders per tenant, atomic writes |
| `settings`                 | `TrainApiSettings` (`CLORA_TRAINAPI_*`) |

How a request travels: the API process checks it, puts it in its model's `seq_id` order and
enqueues it in Redis; the learner process, when its `Scheduler` picks the run (one more view,
with its tenant's weight and priority), runs it on its own model and swapped `AdapterStore`,
and records the outcome, which `retrieve_future` returns. Neither process holds the other's
state: either can restart mid-session (`executor` says what survives a learner restart).

LoRA shape: one rank per learner, attention and MLP projections. `create_model` refuses another
rank or module set with a 400 naming the field, except `train_unembed`: the SDK sends `true` by
default (and tinker-cookbook never changes it), so it is accepted and recorded, and the run
trains attention and MLP only (`TinkerModel.train_unembed_requested`).
"""
