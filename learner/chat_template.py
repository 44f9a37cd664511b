"""The tool-aware ChatML chat template the model is trained and served with.

Base-model preparation (`base_model.py`) writes it into the model directory, so vLLM (with
`--tool-call-parser hermes`) and the learner's tokenizer both render with it: the model is
trained on exactly what it is served with.

SmolLM2's own ChatML template ignores `tools`. `TOOL_CHAT_TEMPLATE` is a Qwen2.5-style
ChatML template. Rendered, a tool-use conversation reads:

    <|im_start|>system
    You solve math word problems.

    Tools:
    - calculator(expression: string): Evaluate an arithmetic expression, e.g. 17*3+2.
    - final_answer(answer: number): Give the final answer.
    To call a tool, reply with:
    <tool_call>
    {"name": <tool-name>, "arguments": <args-json-object>}
    </tool_call><|im_end|>
    <|im_start|>user
    What is 17 times 3?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17*3"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    51
    </tool_response><|im_end|>
    <|im_start|>assistant

Each tool is one signature line: `name(param: type, optional?: type): description`. A parameter
whose schema is more than a bare `type` (a description, an enum, nested items) is written as its
JSON schema; a tool whose parameters are not a plain object of properties gets its whole schema
on a `parameters:` line. So nothing of a schema is lost, and the common case costs a third of
the tokens of one JSON object per tool.

Without tools it renders exactly as SmolLM2's plain ChatML (no default system prompt).
"""

from __future__ import annotations


TOOL_CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages and messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\\n\\n' }}
    {%- endif %}
    {{- 'Tools:' }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {%- set params = tool.parameters or {} %}
        {%- set flat = (params.type is not defined or params.type == 'object') and params | reject('in', ['type', 'properties', 'required',
                                                                                  'additionalProperties']) | list | length == 0 %}
        {{- '\\n- ' + tool.name }}
        {%- if flat %}
            {{- '(' }}
            {%- for name, prop in (params.properties or {}).items() %}
                {%- if not loop.first %}
                    {{- ', ' }}
                {%- endif %}
                {{- name + ('' if name in (params.required or []) else '?') + ': ' }}
                {%- if prop.type is string and prop | length == 1 %}
                    {{- prop.type }}
                {%- else %}
                    {{- prop | tojson }}
                {%- endif %}
            {%- endfor %}
            {{- ')' }}
        {%- endif %}
        {%- if tool.description %}
            {{- ': ' + tool.description }}
        {%- endif %}
        {%- if not flat %}
            {{- '\\n  parameters: ' + (params | tojson) }}
        {%- endif %}
    {%- endfor %}
    {{- '\\nTo call a tool, reply with:\\n<tool_call>\\n' }}
    {{- '{"name": <tool-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if message.content %}
            {{- message.content + '\\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
