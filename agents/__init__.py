"""clora.agents — the tool-using agent side of the platform.

| module            | owns |
|-------------------|------|
| `tools`           | `Tool`, `ToolRegistry`, the safe `Calculator` and `FinalAnswer` |
| `runtime`         | the agent loop on the OpenAI API (`Agent`, `AsyncAgent`) and `EpisodeTrace` |
| `envs`            | environments with rewards: arithmetic (tools), support style, structured output |
| `feedback`        | the feedback webhook client: the tenant SDK's (`clora_client`, sdk/), re-exported |
| `simulate`        | traffic and operator simulators, held-out evaluation |
"""
