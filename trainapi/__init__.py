"""clora.trainapi — a Tinker-compatible training API: the official `tinker` SDK drives clora unchanged.

A Tinker model is a **named run under a tenant**: the tenant is the one whose Tinker key
(`tml-...`, `Registry.create_tinker_key`) created the session, and the run's adapter state is its
own entry in the learner's swapped store (`backend.run_key`), apart from the tenant's
continuously learned adapter. Requests name it by the model id the SDK builds,
`{session_id}:train:{n}`; another tenant's id is answered as unknown (404).

| module                     | owns |
|----------------------------|------|
| `app`                      | `create_app`: the `/api/v1` routes, auth, the error shape, the worker |
| `runs`                     | `Session`, `TinkerModel`: who owns what, model ids |
| `sequencer`                | `Sequencer`: per-model `seq_id` order, retries, gaps |
| `futures`                  | `FutureStore`: request results and the `retrieve_future` long poll |
| `backend`                  | `TrainingBackend` (protocol), `InProcessBackend` on the learner's `Trainer` |
| `losses`                   | `cross_entropy`, `importance_sampling`, `ppo` as token sums on the learner's loss math |
| `wire`                     | the protobuf messages (private pool), decoding requests, encoding results, zstd |
| `tinker_public_descriptor` | the SDK's `tinker_public.proto` schema, vendored as a serialized descriptor |
| `weights`                  | `tinker://` paths, checkpoint folders per tenant, atomic writes |
| `settings`                 | `TrainApiSettings` (`CLORA_TRAINAPI_*`) |

LoRA shape: one rank per learner, attention and MLP projections. `create_model` refuses another
rank or module set with a 400 naming the field, except `train_unembed`: the SDK sends `true` by
default (and tinker-cookbook never changes it), so it is accepted and recorded, and the run
trains attention and MLP only (`TinkerModel.train_unembed_requested`).
"""
