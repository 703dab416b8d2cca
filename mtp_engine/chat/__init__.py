"""Chat requests as prompt text: the Jinja chat template (`template`: the one place templates are
rendered) under its budget (`budget`, `hooks`), the `tojson` filter (`tojson`), and tool calls
(`tool_calls`: rendering tools, forcing a call with a grammar, parsing the calls a model wrote)."""
