//! Replays every committed corpus input and every crash AFL++ found through
//! its target, without AFL: a crash once found and fixed stays fixed.

use std::path::{Path, PathBuf};

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        // README.md and .gitkeep describe the directory; they are not inputs.
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(['.', 'R']))
        })
        .collect();
    out.sort();
    out
}

fn replay(dir: &str, target: &str, run: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join(target);
    let inputs = files(&root);
    for path in &inputs {
        let data = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // Named on failure, so the input to debug is obvious.
        eprintln!("replaying {}", path.display());
        run(&data);
    }
    inputs.len()
}

#[test]
fn every_corpus_input_runs_through_its_target() {
    for (name, run) in remora_fuzz::TARGETS {
        let n = replay("corpus", name, run);
        assert!(n > 0, "fuzz/corpus/{name} holds no seed inputs");
    }
}

#[test]
fn every_crash_found_stays_fixed() {
    for (name, run) in remora_fuzz::TARGETS {
        replay("crashes", name, run);
    }
}

#[test]
fn every_target_has_a_corpus_and_crash_directory() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, _) in remora_fuzz::TARGETS {
        assert!(
            root.join("corpus").join(name).is_dir(),
            "fuzz/corpus/{name}"
        );
        assert!(
            root.join("crashes").join(name).is_dir(),
            "fuzz/crashes/{name}"
        );
    }
}
