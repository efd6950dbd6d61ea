//! Thin entry point: parse the command line, then hand over to the library.
fn main() {
    match remora_agent::config::parse_cli() {
        Ok(cmd) => println!("{cmd:?}"),
        Err(e) => {
            eprintln!("remora-agent: {e}");
            std::process::exit(2);
        }
    }
}
