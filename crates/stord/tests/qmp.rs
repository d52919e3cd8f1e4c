//! QMP end to end: Python scripts drive stord with the `qemu.qmp` client library (installed
//! by scripts/install-deps.sh from tests/qmp/requirements.txt). Each script asserts and exits
//! non-zero on failure; this harness runs one per test.

mod common;

use std::process::Command;

fn run_script(name: &str) {
    let dir = common::tmpdir(&format!("qmp-{}", name.trim_end_matches(".py")));
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/qmp")
        .join(name);
    // Output to files, not pipes: a script that fails may leave daemons behind, and they
    // would hold a pipe open (and this harness waiting) long after the script has ended.
    let (out_path, err_path) = (dir.join("script.out"), dir.join("script.err"));
    let status = Command::new("python3")
        .arg(&script)
        .env("STORD_BIN", env!("CARGO_BIN_EXE_stord"))
        .env("STORD_VERSION", env!("CARGO_PKG_VERSION"))
        .env("STORD_TEST_DIR", &dir)
        .stdout(std::fs::File::create(&out_path).expect("stdout file"))
        .stderr(std::fs::File::create(&err_path).expect("stderr file"))
        .status()
        .expect("python3");
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    assert!(
        status.success() && stdout.contains("PASS"),
        "{name} failed:\n{stdout}\n{stderr}"
    );
}

#[test]
fn qmp_adds_a_node_and_an_export_at_runtime() {
    run_script("runtime_export.py");
}

#[test]
fn qmp_tunes_polling_live() {
    run_script("poll_tuning.py");
}

#[test]
fn qmp_survives_bad_input() {
    run_script("bad_input.py");
}

#[test]
fn qmp_deletes_an_export_under_load() {
    run_script("delete_under_load.py");
}

#[test]
fn qmp_query_shapes_match_qemu_storage_daemon() {
    run_script("compare_qsd.py");
}

#[test]
fn qmp_open_errors_read_as_qsd_writes_them() {
    run_script("open_errors.py");
}

#[test]
fn qmp_reopen_and_transaction_answer_as_qsd() {
    run_script("reopen_transaction.py");
}

#[test]
fn qmp_inactive_nodes_hand_an_image_over_as_qsd() {
    run_script("inactive.py");
}

#[test]
fn qmp_monitor_modes_and_text_match_qsd() {
    run_script("monitor_modes.py");
}

#[test]
fn qmp_schema_is_generated_from_the_command_table_and_agrees_with_qsd() {
    run_script("schema.py");
}

#[test]
fn qmp_blockdev_create_jobs_answer_as_qsd() {
    run_script("jobs_create.py");
}

#[test]
fn qmp_block_stream_and_job_verbs_answer_as_qsd() {
    run_script("stream.py");
}

#[test]
fn qmp_block_commit_of_intermediate_images_answers_as_qsd() {
    run_script("commit.py");
}

#[test]
fn qmp_mirror_and_active_commit_pivot_exports_as_qsd() {
    run_script("mirror.py");
}

#[test]
fn qmp_external_snapshots_move_exports_as_qsd() {
    run_script("snapshot.py");
}

#[test]
fn qmp_dirty_bitmaps_answer_as_qsd() {
    run_script("bitmaps.py");
}

#[test]
fn qmp_persistent_bitmaps_in_qcow2_as_qsd() {
    run_script("persistent_bitmaps.py");
}

#[test]
fn nbd_exports_dirty_bitmaps_as_qsd() {
    run_script("nbd_bitmaps.py");
}

#[test]
fn qmp_nbd_client_node_answers_as_qsd_and_survives_its_server() {
    run_script("nbd_client.py");
}

#[test]
fn qmp_rbd_node_on_a_real_ceph_cluster_answers_as_qsd() {
    run_script("rbd.py");
}

#[test]
fn qmp_backup_push_and_pull_as_qsd() {
    run_script("backup.py");
}

#[test]
fn qmp_backup_compress_writes_compressed_clusters_as_qsd() {
    run_script("backup_compress.py");
}

#[test]
fn qmp_smaller_qsd_commands_answer_as_qsd() {
    run_script("qsd_commands.py");
}

#[test]
fn qmp_drive_backup_and_drive_mirror_as_qsd() {
    run_script("drive_jobs.py");
}

#[test]
fn qmp_mirror_switched_to_write_blocking_as_qsd() {
    run_script("active_mirror.py");
}

#[test]
fn qmp_internal_snapshots_as_qsd() {
    run_script("internal_snapshots.py");
}

#[test]
fn qmp_fleecing_with_copy_before_write_and_snapshot_access_as_qsd() {
    run_script("fleecing.py");
}

#[test]
fn qmp_metrics_listener_serves_openmetrics() {
    run_script("metrics.py");
}

#[test]
fn qmp_pull_backup_exports_a_recording_bitmap_by_node_and_name_as_qsd() {
    run_script("bitmap_pull_export.py");
}

#[test]
fn qmp_mirror_target_is_zero_leaves_a_sparse_target_sparse() {
    run_script("mirror_target_is_zero.py");
}

#[test]
fn nbd_keep_alive_reaches_both_ends_sockets() {
    run_script("keep_alive.py");
}

#[test]
fn qmp_qom_list_get_reads_what_qsd_lists_and_gets() {
    run_script("qom_list_get.py");
}

#[test]
fn qmp_block_nodes_report_children_and_limits_as_qemu_10_2() {
    run_script("block_nodes.py");
}

#[test]
fn qmp_monitors_are_made_and_removed_at_run_time_as_qemu_11_1() {
    run_script("monitor_object.py");
}

#[test]
fn qmp_chardev_logs_as_qsd_with_qemu_11_timestamps() {
    run_script("chardev_log.py");
}
