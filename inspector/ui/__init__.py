"""The Streamlit glue that app.py and the pages share: `frame` (the area around a page), `sidebar` (prompt, Run,
the page links, settings), `common` (the model, the current run, limits, on-demand jobs), `widgets` (tables,
charts, page links, projector mode), `demos`, `prescriptions`, and the rooms' screens (`room`, `room_sync`,
`room_push` with its watcher thread, `room_poll`, `room_live`, `room_outage`)."""
