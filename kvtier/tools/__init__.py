"""Tools on top of the cache: the decode benchmark (bench), the device-memory planner behind ``kvtier plan`` (memplan), tier-map renderers (viz), headless-browser checks of the pages (browser)."""
