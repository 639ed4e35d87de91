"""What the app shows, apart from its pages: `views` turns what the engine's probes captured into pandas tables
and plotly figures (pure: no Streamlit, threads or environment); `session` holds a server's sessions, runs,
limits and rooms (no Streamlit); `ui` is the Streamlit glue the pages share (the frame, the sidebar, widgets,
demos, the rooms' screens and their watcher). pages/ holds exactly the pages app.py navigates to."""
