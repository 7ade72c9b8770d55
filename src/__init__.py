"""prefkit: DPO and SFT on Hugging Face TRL under torchrun, with pre-launch diagnostics and readable results."""

import logging

# bitsandbytes warns on every CPU import that an optional kernel package ("kernels", which reaches for the Hub) is
# missing; its pure-PyTorch fallback is used instead. The line alarms users and says nothing actionable.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
