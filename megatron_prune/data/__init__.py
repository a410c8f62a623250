"""Datasets (preference pairs, math problems), tokenizers, sample order and bundled samples.

Bundled files (attribution in ``samples/README.md``): small HH-RLHF and GSM8K samples and the
tiny tokenizer (``load_tokenizer("tiny")``). Nothing is downloaded at run time.
"""

import os

SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples")
HH_RLHF_SAMPLE = os.path.join(SAMPLES_DIR, "hh_rlhf_sample.jsonl")
"""400 HH-RLHF harmless-base preference pairs (training sample)."""
HH_RLHF_HELDOUT = os.path.join(SAMPLES_DIR, "hh_rlhf_heldout.jsonl")
"""100 further HH-RLHF pairs, disjoint from HH_RLHF_SAMPLE (evaluation)."""
GSM8K_SAMPLE = os.path.join(SAMPLES_DIR, "gsm8k_sample.jsonl")
"""300 GSM8K training problems."""
