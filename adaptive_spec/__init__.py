"""adaptive-spec."""
