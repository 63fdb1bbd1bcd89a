"""The CAPO math, pure: steps, critique parsing, voting, token rewards and advantages,
token/step alignment, paired significance. No I/O, no engines, no orchestrator."""
