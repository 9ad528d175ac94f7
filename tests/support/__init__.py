"""What several test folders share: free ports, process launchers and probes, the real engine
server and `baton router` in subprocesses, uvicorn in a thread, the fake engine, fake KV peers."""
