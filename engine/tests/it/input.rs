//! `input::read_text`: a regular file within its limit is read; a device, a directory, a FIFO or
//! a larger file is refused, typed, without blocking.

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
