//! `input::read_text`: a regular file within its limit is read; a device, a directory, a FIFO or
//! a larger file is refused, typed, without blocking; `Config::base_preset_of` reads a file through it.

use std::path::Path;
use tierkv_engine::input::{read_text, InputError};

#[test]
fn only_regular_files_within_the_limit_are_read() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("input");
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("a.txt");
    std::fs::write(&f, "12345").unwrap();
    assert_eq!(read_text(&f, 5).as_deref(), Ok("12345"));
    assert_eq!(read_text(&f, 4), Err(InputError::TooLarge { bytes_max: 4 }));
    assert_eq!(read_text(&dir, 5), Err(InputError::NotAFile));
    assert_eq!(
        read_text(Path::new("/dev/zero"), 5),
        Err(InputError::NotAFile)
    );
    assert!(matches!(
        read_text(&dir.join("missing"), 5),
        Err(InputError::Io(_))
    ));
    // A FIFO nobody writes to: opening it to read would block for ever.
    let fifo = dir.join("fifo");
    let _ = std::fs::remove_file(&fifo);
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success(), "mkfifo {}", fifo.display());
    assert_eq!(read_text(&fifo, 5), Err(InputError::NotAFile));
}

/// `Config::base_preset_of` answers the preset a TOML or JSON file starts from, and nothing for
/// a file that names none or cannot be read.
#[test]
fn a_files_base_preset_is_its_preset_key() {
    use tierkv_engine::config::Config;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("base-preset");
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let toml = file(
        "a.toml",
        "preset = \"deepseek-v3.2\"\n[cache]\ndevice_pages = 64\n",
    );
    let json = file(
        "b.json",
        "{\"preset\": \"sim-small\", \"cache\": {\"device_pages\": 64}}",
    );
    let none = file("c.toml", "[cache]\ndevice_pages = 64\n");
    assert_eq!(
        Config::base_preset_of(&toml).as_deref(),
        Some("deepseek-v3.2")
    );
    assert_eq!(Config::base_preset_of(&json).as_deref(), Some("sim-small"));
    assert_eq!(Config::base_preset_of(&none), None);
    assert_eq!(Config::base_preset_of(&dir.join("missing.toml")), None);
}
