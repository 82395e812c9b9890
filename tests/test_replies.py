"""The corpus of regenerated replies (train/replies.py): grows across runs, survives a kill
mid-write, is safe to read while a run writes, refuses replies made under other settings."""

import gzip
import os

import pytest

from train.replies import Replies, RepliesError

ARGS = ("tiny-target", 12, "float32")


def test_replies_persist_by_prompt_across_runs(tmp_path):
    a = Replies(str(tmp_path), *ARGS)
    a.add([([1, 2, 3, 9, 9], 3), ([4, 5, 8], 2)])
    a.add([([6, 7], 1)])
    b = Replies(str(tmp_path), *ARGS)  # another run
    assert len(b) == 3 and b.reply_tokens() == 2 + 1 + 1
    assert b.get([1, 2, 3]) == ([1, 2, 3, 9, 9], 3) and b.get([4, 5]) == ([4, 5, 8], 2)
    assert b.get([1, 2]) is None and b.get([1, 2, 3, 9]) is None
    b.add([([1, 2, 3, 7], 3), ([10], 1)])  # a second answer to a known prompt does not replace it
    assert sorted(os.listdir(tmp_path)) == ["meta.json", "part-0000.jsonl.gz", "part-0001.jsonl.gz"]
    c = Replies(str(tmp_path), *ARGS)
    assert len(c) == 4 and c.get([1, 2, 3]) == ([1, 2, 3, 9, 9], 3)


def test_a_batch_cut_by_a_kill_is_skipped_and_no_reader_rewrites_a_part(tmp_path):
    """A cut last member is a killed run's, or one a running job is still writing: readers skip it
    and leave the file as it is (rewriting it would drop the running job's batch)."""
    a = Replies(str(tmp_path), *ARGS)
    a.add([([1, 2, 3], 2)])
    a.add([([4, 5, 6], 2)])
    part = tmp_path / "part-0000.jsonl.gz"
    whole = part.read_bytes()
    with gzip.open(tmp_path / "member.gz", "wb") as fh:  # the size of the last member
        fh.write(b'{"ids":[4,5,6],"prompt_len":2}\n')
    cut = len(whole) - (tmp_path / "member.gz").stat().st_size // 2
    part.write_bytes(whole[:cut])  # killed while writing the second batch
    os.remove(tmp_path / "member.gz")
    b = Replies(str(tmp_path), *ARGS)
    assert len(b) == 1 and b.get([4, 5]) is None
    assert part.read_bytes() == whole[:cut]
    b.add([([4, 5, 7], 2)])
    c = Replies(str(tmp_path), *ARGS)
    assert len(c) == 2 and c.get([4, 5]) == ([4, 5, 7], 2) and c.get([1, 2]) == ([1, 2, 3], 2)


@pytest.mark.parametrize(
    "other, key",
    [
        (("other-target", 12, "float32"), "target"),
        (("tiny-target", 16, "float32"), "max_new_tokens"),
        (("tiny-target", 12, "bfloat16"), "dtype"),
    ],
)
def test_replies_of_other_settings_are_refused(tmp_path, other, key):
    Replies(str(tmp_path), *ARGS).add([([1, 2], 1)])
    with pytest.raises(RepliesError, match=f"generated with {key}="):
        Replies(str(tmp_path), *other)
