"""Rebuild the bundled data samples from the shared copies of HH-RLHF and GSM8K (run once).

    python megatron_prune/data/samples/build_samples.py --data-dir /path/to/raw/data

Selection is deterministic (file order, no randomness):

* HH-RLHF (harmless-base test split): records whose ``chosen`` and ``rejected`` share the
  dialogue up to the last ``"\\n\\nAssistant:"``, have non-empty, different responses, and are
  at most ``MAX_HH_CHARS`` characters each; the first ``HH_TRAIN`` go to
  ``hh_rlhf_sample.jsonl``, the next ``HH_HELDOUT`` to ``hh_rlhf_heldout.jsonl``.
* GSM8K (train split): the first ``GSM8K_COUNT`` problems, to ``gsm8k_sample.jsonl``.

Records are copied unchanged (same fields, UTF-8, one JSON object per line).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil

HH_TRAIN = 400
HH_HELDOUT = 100
GSM8K_COUNT = 300
MAX_HH_CHARS = 1200
ASSISTANT = "\n\nAssistant:"
HERE = os.path.dirname(os.path.abspath(__file__))


def hh_is_clean(record: dict) -> bool:
    chosen, rejected = record["chosen"], record["rejected"]
    if max(len(chosen), len(rejected)) > MAX_HH_CHARS or chosen == rejected:
        return False
    cut_c, cut_r = chosen.rfind(ASSISTANT), rejected.rfind(ASSISTANT)
    if cut_c < 0 or cut_r < 0:
        return False
    end_c, end_r = cut_c + len(ASSISTANT), cut_r + len(ASSISTANT)
    if chosen[:end_c] != rejected[:end_r]:
        return False
    return bool(chosen[end_c:].strip()) and bool(rejected[end_r:].strip())


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="folder holding hh-rlhf/ and gsm8k/")
    args = parser.parse_args()

    with gzip.open(os.path.join(args.data_dir, "hh-rlhf", "harmless-base-test.jsonl.gz"), "rt", encoding="utf-8") as handle:
        hh = [r for r in map(json.loads, handle) if hh_is_clean(r)]
    assert len(hh) >= HH_TRAIN + HH_HELDOUT, len(hh)
    write_jsonl(os.path.join(HERE, "hh_rlhf_sample.jsonl"), hh[:HH_TRAIN])
    write_jsonl(os.path.join(HERE, "hh_rlhf_heldout.jsonl"), hh[HH_TRAIN : HH_TRAIN + HH_HELDOUT])

    with open(os.path.join(args.data_dir, "gsm8k", "train.jsonl"), encoding="utf-8") as handle:
        gsm8k = [json.loads(line) for _, line in zip(range(GSM8K_COUNT), handle)]
    write_jsonl(os.path.join(HERE, "gsm8k_sample.jsonl"), gsm8k)

    shutil.copyfile(os.path.join(args.data_dir, "hh-rlhf", "LICENSE"), os.path.join(HERE, "LICENSE.hh-rlhf"))
    shutil.copyfile(os.path.join(args.data_dir, "gsm8k", "LICENSE"), os.path.join(HERE, "LICENSE.gsm8k"))


if __name__ == "__main__":
    main()
