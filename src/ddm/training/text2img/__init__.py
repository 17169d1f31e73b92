"""Training the text-to-image DDM, stage by stage, into one diffusers-style directory."""
