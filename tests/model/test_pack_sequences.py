"""pack_sequences: the int64 tensors torch.tensor(prompt + completion) gives, and a clear error for
ids that are not integers (floats were once truncated silently)."""
import pytest
import torch

from zmrl.model.logprobs import pack_sequences


def test_the_ids_of_each_pair_end_to_end():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2**40, (n,), generator=g).tolist() for n in (1, 7, 300)]
    completions = [torch.randint(0, 50_000, (n,), generator=g).tolist() for n in (3, 1, 120)]
    got = pack_sequences(prompts, completions)
    for seq, p, c in zip(got, prompts, completions):
        want = torch.tensor(p + c, dtype=torch.long)
        assert seq.dtype == torch.int64 and torch.equal(seq, want)
    got[0][0] = -5  # each tensor owns its storage: writable, the caller's lists untouched
    assert prompts[0][0] != -5 and got[1][0] == prompts[1][0]


@pytest.mark.parametrize("bad, why", [(1.5, "float"), ("7", "str"), (2**63, "too big")])
def test_ids_that_are_not_int64_integers_raise(bad, why):
    with pytest.raises(ValueError, match=rf"sequence 1: token ids must be integers in the int64 range \(.*{why}"):
        pack_sequences([[1, 2], [3]], [[4], [5, bad]])


def test_empty_prompt_or_completion_raises():
    with pytest.raises(ValueError, match="sequence 0: empty prompt or completion"):
        pack_sequences([[]], [[1]])
