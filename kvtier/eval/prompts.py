"""Prompts in the R1 style, formatted with the model's chat template."""

from __future__ import annotations

from .datasets import Problem, base_benchmark

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
ARC_INSTRUCTION = "Please reason step by step, and put the letter of your final answer within \\boxed{}."


def user_message(benchmark: str, p: Problem) -> str:
    if base_benchmark(benchmark) == "arc_challenge":
        lines = [p.question, ""] + [f"{'ABCDEFGH'[i]}. {t}" for i, t in enumerate(p.choices)]
        return "\n".join(lines) + "\n\n" + ARC_INSTRUCTION
    return f"{p.question}\n{INSTRUCTION}"


def build_prompt(tokenizer, benchmark: str, p: Problem) -> str:
    content = user_message(benchmark, p)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return content + "\n"
