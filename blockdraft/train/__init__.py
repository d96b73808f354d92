"""Training DFlash drafters: data regeneration, anchors and masks, the trainer."""
