"""clora.ingest — from feedback and served interactions to per-tenant training examples.

| module     | owns |
|------------|------|
| `schemas`  | the events on Kafka (interaction, feedback, adapter, dead letter), the training examples, the topic names |
| `webhook`  | the feedback webhook `POST /v1/feedback[/batch]` (202 only once the broker acknowledged) |
| `producer` | topic creation and the acks=all `EventProducer` whose writes can be awaited |
| `worker`   | the ingest worker: consume, validate, join, store, then commit |
| `joiner`   | one interaction + one feedback record -> training examples |
| `buffers`  | the per-tenant replay buffers in Redis (their keys and Lua scripts), sampling for the learner |
| `signals`  | `ReplyTraits`, `ServedSignals`: what served replies say about their version (empty, tool calls, length, diversity) |
| `reports`  | what workers leave in Redis for the console: consumer lag, the latest dead letters |
| `metrics`  | the Prometheus metrics of the webhook and the workers |
| `settings` | the webhook's and the workers' settings |
"""
