"""Fine-tuning: chat and preference data, exact packing, the SFT and DPO losses and the DPO reference."""
