"""A deployed runner's greedy answer with its artifact's tokenizer (tests of the slim deploy)."""

from transformers import AutoTokenizer

from gemma_nb.neuron.deploy import until_eos

PROMPT = "The capital of France is"


def greedy_answer(runner, folder, max_new_tokens: int, prompt: str = PROMPT) -> str:
    """``runner``'s greedy answer to ``prompt``, cut at the first end-of-sequence token."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids, eos = tokenizer(prompt).input_ids, tokenizer.eos_token_id
    new = runner.generate([ids], max_new_tokens, eos_token_id=eos)[0, len(ids) :].tolist()
    return tokenizer.decode(until_eos(new, eos)).strip()
