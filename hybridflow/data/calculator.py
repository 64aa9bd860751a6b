"""The embedded agent task: 3x3-digit multiplication with a calculator tool.

A tiny model cannot multiply two 3-digit numbers in its head, but it can learn to call the
calculator and copy its answer: "123*456=" -> `<calc>123*456</calc>` (the model's first turn
ends at the closing tag) -> `<result>56088</result>` (the tool's output, not trained) ->
`56088` EOS (the final answer, rewarded by exact match). With
`data.synthetic.calculator_demonstrations=true` the training rows carry that trajectory as a
`demonstration` column (model turns and observations alternating) for the SFT stage.
"""

from __future__ import annotations

import ast
import operator


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_DIGITS = 12  # bounds the work one call can ask for (no 9**9**9)


def calc(expression: str) -> str:
    """Evaluate an integer expression with + - * and parentheses, e.g. 123*456 -> 56088."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Constant) and type(node.value) is int and len(str(node.value)) <= MAX_DIGITS:
            return node.value
        raise ValueError(f"not an integer expression: {expression[:30]!r}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an integer expression: {expression[:30]!r}") from None
    return str(value(tree.body))


def demonstration(prompt: str) -> list[str]:
    """The tool-using trajectory for `prompt` ("a*b="): model turn, observation, model turn."""
    expression = prompt.rstrip("=")
    answer = calc(expression)
    return [f"<calc>{expression}</calc>", f"<result>{answer}</result>", answer]

