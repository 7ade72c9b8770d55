"""prefkit: DPO and SFT on Hugging Face TRL under torchrun, with pre-launch diagnostics and readable results."""
