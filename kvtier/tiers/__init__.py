"""Which token lives where: pure index logic over scores and positions (planner, layout, int8 format, tier maps); no K/V is moved here."""
