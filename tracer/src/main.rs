fn main() {
    gputrace::probe::preflight().unwrap();
    let layout = gputrace::abi::Layout::for_version(gputrace::abi::DriverVersion::new(580, 95, 5));
    match gputrace::probe::Probe::load(&layout, false) {
        Ok(p) => println!("loaded; counters {:?}", p.counters()),
        Err(e) => println!("ERR {e}"),
    }
}
