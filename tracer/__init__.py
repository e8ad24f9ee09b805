"""Model spec -> OpGraph. Knows nothing of devices."""
