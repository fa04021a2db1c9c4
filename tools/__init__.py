"""Developer tools that are not part of the product (mutation testing)."""
