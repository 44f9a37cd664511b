"""clora.agents.envs: environments with rewards — problem generators, held-out sets, reward
functions and reference answers for operator corrections.

| module       | owns |
|--------------|------|
| `base`       | `Problem`, the `Environment` protocol, `TaskEnv` (training stream, held-out sets `same` and `unseen`), difficulties |
| `arithmetic` | `ArithmeticEnv`: word problems solved with the calculator and `final_answer` tools |
| `support`    | `SupportEnv`: support replies in the house style (greeting, order number, sign-off) |
| `structured` | `StructuredEnv`: fields of an order note as one JSON object with exactly the keys asked |
| `retail`     | `RetailEnv`: τ-bench-style customer service, many turns with the store's tools and a simulated customer |
| `retail_store` | the retail store's database, its eight tools and their policy |

`ENVIRONMENTS` maps a task name to its class.
"""

from clora.agents.envs.arithmetic import ArithmeticEnv
from clora.agents.envs.base import DIFFICULTIES, FAMILIES, Difficulty, Environment, Family, Problem, TaskEnv
from clora.agents.envs.retail import RetailEnv
from clora.agents.envs.structured import StructuredEnv
from clora.agents.envs.support import SupportEnv

ENVIRONMENTS: dict[str, type[TaskEnv]] = {e.name: e for e in (ArithmeticEnv, SupportEnv, StructuredEnv, RetailEnv)}

__all__ = ["ArithmeticEnv", "RetailEnv", "StructuredEnv", "SupportEnv", "Environment", "Problem", "TaskEnv", "Difficulty",
           "DIFFICULTIES", "ENVIRONMENTS", "FAMILIES", "Family"]
